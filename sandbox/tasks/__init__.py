"""Tasks: what an agent is asked and how its work is graded, in each format a dataset comes in; the task maker."""
