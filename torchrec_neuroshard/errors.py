"""The package's errors: one type for bad input, and one for a plan that does not fit."""


class ShardingError(ValueError):
    """A task, a plan or a TorchRec input that cannot be turned into a valid sharding: the
    package's one error type for bad input. Its message says what to change."""


class InfeasibleError(ShardingError):
    """No placement satisfies the memory cap."""
