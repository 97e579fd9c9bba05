# Shared by the unattended GPU-machine sessions (session.sh, sm80_offload.sh): the machine goes back 30 s
# after a call, so a session runs in the background (setsid) and each device call only polls it. Sourced;
# the caller sets W (work dir) and R (results dir) and writes "all done" to $R/session.log at the end.
say() { echo "$(date +%T) $*" >> $R/session.log; }

collect() {  # everything so far, as one file (at most 8 come back)
  [ -d $R ] && tar -C $W -czf "$OUT/results.tgz" results 2> /dev/null
  tail -${TAIL:-60} $R/session.log 2> /dev/null
  grep -ho '\[[0-9]*/[0-9]*\]' $W/cache/build/*/llamabundle-build.log $W/c80/build/*/llamabundle-build.log 2> /dev/null | tail -1
  tail -2 $W/build.log 2> /dev/null
}

poll() {  # wait at most POLL_S seconds for the end (UNTIL_NEW=1: for a few new log lines), then collect
  local n0
  if [ ! -f $R/session.log ]; then  # a fresh machine: the one that ran the session was given back
    echo "error: no session on this machine ($R/session.log missing): the machine was given back and its work lost; start again" >&2
    return 3
  fi
  n0=$(wc -l < $R/session.log 2> /dev/null || echo 0)
  for _ in $(seq 1 $(( ${POLL_S:-560} / 5 ))); do
    grep -q "all done\|B: no zip" $R/session.log 2> /dev/null && break
    [ "${UNTIL_NEW:-0}" = 1 ] && [ "$(wc -l < $R/session.log)" -gt "$((n0 + 2))" ] && break
    sleep 5
  done
  collect
}
