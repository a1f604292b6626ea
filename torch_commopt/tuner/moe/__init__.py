"""The expert-parallel schedules' cost model and the `auto` choice (docs/moe.md)."""
