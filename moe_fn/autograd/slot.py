"""The one-shot weight-gradient slot of the overlap (not a record: it is filled and drained)."""

from __future__ import annotations


class WeightGradSlot:
    """Filled by the experts' backward with what the dW GEMMs need; drained by the
    dispatch backward, which runs those GEMMs while the combine of dX is in flight (once
    per backward through the graph)."""

    __slots__ = ("_work", "_state")

    def __init__(self):
        self._work = None
        self._state = "empty"

    def fill(self, work) -> None:
        # "drained": a second backward through a retained graph (retain_graph=True) runs
        # the experts' and the dispatch's backward again, filling and draining in turn.
        if self._state == "filled":
            raise RuntimeError(
                "moe_fn overlap_weight_grad: the weight-gradient slot was filled twice; the "
                "previous backward's weight gradients were never drained by the dispatch "
                "backward (was the dispatch's output detached from the experts' input?)")
        self._work, self._state = work, "filled"

    def drain(self):
        if self._state != "filled":
            raise RuntimeError(
                f"moe_fn overlap_weight_grad: the weight-gradient slot is {self._state}; each "
                "dispatch backward drains what the experts' backward before it filled (was "
                "the dispatch's output detached from the experts' input?)")
        work, self._work, self._state = self._work, None, "drained"
        return work
