"""Task formats: each reads its files into `sandbox.tasks.task.Task`s, with a grader and, where it has one, a solver."""
