"""Triggers: the periodic policy, signals and cloud preemption notices, and the deadline-aware planner."""
