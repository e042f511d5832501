"""The one-shot weight-gradient slot of the overlap (not a record: it is filled and drained)."""

from __future__ import annotations


class WeightGradSlot:
    """Filled once by the experts' backward with what the dW GEMMs need; drained once by
    the dispatch backward, which runs those GEMMs while the combine of dX is in flight."""

    __slots__ = ("_work", "_state")

    def __init__(self):
        self._work = None
        self._state = "empty"

    def fill(self, work) -> None:
        if self._state != "empty":
            raise RuntimeError(
                "moe_fn overlap_weight_grad: the weight-gradient slot was filled twice; the "
                "previous backward's weight gradients were never drained by the dispatch "
                "backward (was the dispatch's output detached from the experts' input?)")
        self._work, self._state = work, "filled"

    def drain(self):
        if self._state != "filled":
            raise RuntimeError(
                f"moe_fn overlap_weight_grad: the weight-gradient slot is {self._state}; each "
                "slot is filled by one experts backward and drained by one dispatch backward "
                "(a second backward through the same graph is not supported)")
        work, self._work, self._state = self._work, None, "drained"
        return work
