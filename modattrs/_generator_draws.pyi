def mt19937_uniform(
    state: int,
    layout: tuple[int, int, int],
    address: int,
    count: int,
    dtype: str,
    low: float,
    high: float,
    form: str,
    fused: bool,
    /,
) -> None: ...
