#!/bin/bash
# The verifier writes named rewards: `count` for the right number, `format` for a number and a newline, and
# `reward`, the episode's return: the count's (the others stay visible by name).
count=0 format=0
[ "$(tr -d '[:space:]' < /app/count.txt 2>/dev/null)" = "$EXPECTED" ] && count=1
grep -qxE '[0-9]+' /app/count.txt 2>/dev/null && [ "$(tail -c1 /app/count.txt | od -An -c | tr -d ' ')" = '\n' ] && format=1
printf '{"reward": %s, "count": %s, "format": %s}\n' "$count" "$count" "$format" > /logs/verifier/reward.json
