
# A deliberate wrong change to moe_fn, only when asked for (tests/test_mutations.py).
from tests.mutations import apply_from_env  # noqa: E402

apply_from_env()
