"""What judges the planner, torch-free: published runs (`published`) and the article's claims
(`claims`) against the catalog, the planner and the measured results. Not part of the cost
model: nothing in `plan/` imports it."""
