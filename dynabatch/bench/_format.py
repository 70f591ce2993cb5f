"""Number formatting shared by the benchmark tables."""


def fmt_rate(x: float) -> str:
    """A rate per second with a k/M suffix: ``12.3 k``, ``4.56 M``."""
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.0f}"
