"""What the planner's commands print and draw, torch-free: rich tables, JSON, PNG charts. The
cost model (`plan/`) neither prints nor draws; these modules render its results."""
