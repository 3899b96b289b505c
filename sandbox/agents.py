"""Agent presets: the command that starts each known agent inside a sandbox.

`{task_file}` is a file holding the task's text, `{workdir}` the task's working directory (quoted).
"""

AGENTS = {"minimal": "minimal-agent @{task_file} --workdir {workdir}"}
