"""The package's errors: one type for bad input, and one for a plan that does not fit.

Both are TorchRec ``PlannerError``s (with its ``error_type``), so a caller's ``except
PlannerError:`` fallback around ``planner.plan`` catches ours as it catches TorchRec's, and
``ValueError``s, as bad input is in Python."""

try:
    from torchrec.distributed.planner.types import PlannerError, PlannerErrorType
except ImportError:  # the lab's measuring runs without TorchRec (test_layout): no caller catches its PlannerError there
    import enum

    class PlannerErrorType(enum.Enum):  # type: ignore[no-redef]
        INSUFFICIENT_STORAGE = "insufficient_storage"
        INPUT_VALIDATION = "input_validation"

    class PlannerError(Exception):  # type: ignore[no-redef]
        def __init__(self, message: str, error_type: PlannerErrorType = PlannerErrorType.INPUT_VALIDATION) -> None:
            self.error_type = error_type
            super().__init__(message)

INPUT_VALIDATION = getattr(PlannerErrorType, "INPUT_VALIDATION", None) or PlannerErrorType.OTHER
"""Bad input's error type: TorchRec's INPUT_VALIDATION, or OTHER on torchrec 1.6.1 (the lent
GPUs' release, benchmarks/gpu/bundle.py), which has no INPUT_VALIDATION."""


class ShardingError(ValueError, PlannerError):
    """A task, a plan or a TorchRec input that cannot be turned into a valid sharding: the
    package's one error type for bad input. Its message says what to change."""

    def __init__(self, message: str, error_type: PlannerErrorType = INPUT_VALIDATION) -> None:
        PlannerError.__init__(self, message, error_type)


class InfeasibleError(ShardingError):
    """No placement satisfies the memory cap."""

    def __init__(self, message: str, error_type: PlannerErrorType = PlannerErrorType.INSUFFICIENT_STORAGE) -> None:
        super().__init__(message, error_type)
