"""The planning layer's error: nothing fits the budget, or the planner was misused."""


class PlanError(ValueError):
    """Nothing fits the budget (the message suggests what would), or the planner was misused."""
