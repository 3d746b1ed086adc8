from typing_extensions import Buffer

def mt19937_uniform(
    array: Buffer,
    left: int,
    next: int,
    address: int,
    count: int,
    dtype: str,
    low: float,
    high: float,
    form: str,
    fused: bool,
    /,
) -> tuple[int, int]: ...
