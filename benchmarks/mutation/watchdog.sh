#!/usr/bin/env bash
# Stops a hung mutant: while `mutmut run` is alive, any of its per-mutant children ("mutmut: <name>") running longer
# than LIMIT seconds (default 150; the slowest killed mutant of the scope takes ~40 s) is killed. mutmut records it as
# killed by a signal ("segfault"), which mutation.py counts as killed, like a timeout: the mutant made the tests hang.
# Started by `make mutation`; each stop is logged to build/mutation/watchdog.log.
LIMIT=${1:-150}
LOG=${2:-build/mutation/watchdog.log}
sleep 5
while pgrep -f "mutmut run" >/dev/null; do
  for pid in $(pgrep -f "^mutmut: "); do
    age=$(ps -o etimes= -p "$pid" 2>/dev/null | tr -d ' ')
    if [ -n "$age" ] && [ "$age" -gt "$LIMIT" ]; then
      echo "$(date -u +%T) stopped after ${age}s: $(ps -o args= -p "$pid")" >> "$LOG"
      kill -9 "$pid"
    fi
  done
  sleep 10
done
