"""How the CLI writes sizes, token counts and durations (binary units, as Mac memory is sold)."""

from __future__ import annotations


def size(b) -> str:
    """Bytes as MB below a GB, else GB; "n/a" for None."""
    if b is None:
        return "n/a"
    if b == 0:
        return "0"
    if b < 2**30:
        return f"{b / 2**20:,.1f} MB"
    return f"{b / 2**30:,.1f} GB"


def gb(b) -> str:
    return f"{b / 2**30:,.1f} GB"


def short_size(b) -> str:
    """Compact, for tables: 1.5G, 300M, -."""
    return "-" if b is None else f"{b / 2**30:.1f}G" if b >= 2**30 else f"{b / 2**20:.0f}M"


def tokens_k(n: int) -> str:
    """8192 -> 8K; other counts with separators."""
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def number(x) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:,.2f}"


def context(n) -> str:
    return "n/a" if n is None else ("none" if n == 0 else f"{n:,}")


def age(s) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 60}m{s % 60}s"
