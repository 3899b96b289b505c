# Stages side by side, for .ci/run (sourced): `alongside NAME COMMAND...` starts one in the background, its output
# kept apart; `together STAGE` waits for those started since the last `together` (and for nothing else the caller
# runs in the background), prints each one's output whole, in the order they were started, with how long it took
# from its own start and its exit status, then ends the caller's stage STAGE (its `stage` function) and fails
# (`exit 1`, naming them) if any failed.

lanes=""
lane_pids=()
alongside() {
  local log
  [ -d "$lanes" ] || lanes=$(mktemp -d)
  log="$lanes/${#lane_pids[@]}.log"
  echo "$1" >"$log"
  shift
  { local rc=0 began=$SECONDS; "$@" >>"$log" 2>&1 || rc=$?; echo "$rc $((SECONDS - began))" >"${log%.log}.end"; } &
  lane_pids+=($!)
}

together() {
  local pid log name failed=() rc took
  for pid in "${lane_pids[@]}"; do
    wait "$pid" || true  # (each one's status is in its .end)
  done
  lane_pids=()
  [ -d "$lanes" ] || { stage "$1"; return; }  # (none was started)
  for log in $(find "$lanes" -name '*.log' | sort -V); do
    name=$(head -n 1 "$log")
    tail -n +2 "$log"
    read -r rc took <"${log%.log}.end"
    echo ".ci/run: $name took $took s (side by side), exit status $rc" >&2
    [ "$rc" = 0 ] || failed+=("$name")
  done
  rm -rf "$lanes"
  stage "$1"
  [ "${#failed[@]}" = 0 ] || { printf '.ci/run: failed: %s\n' "${failed[@]}" >&2; exit 1; }
}
