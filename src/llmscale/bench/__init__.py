"""Measured vs predicted: short real trainings, side by side with the planner's predictions."""
