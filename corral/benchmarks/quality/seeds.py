"""What every generated suite shares (suites.py, hard_suites.py): the item count, the seeded generator and the
calendar words, kept apart so that both modules import them without importing each other."""

from __future__ import annotations

import random

ITEMS = 20
CURRENCIES = ("USD", "EUR", "GBP", "JPY")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")


def rng(task: str) -> random.Random:
    """The task's generator: `random.Random` seeded with a string is stable across Python versions and
    processes, so every machine and run asks the same items."""
    return random.Random(f"corral-quality-{task}")


def ordinal(day: int) -> str:
    return "th" if 10 <= day % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
