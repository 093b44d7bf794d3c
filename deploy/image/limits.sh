# Sourced by deploy/image/build.sh and deploy/image/run.sh: the `--ulimit` flags a container
# gets, in the bash array ULIMITS.
#
# podman asks runc for its own default limits (nofile 1048576, nproc at the host's), and
# runc cannot raise a limit above the caller's: rootless, or nested in another container,
# `podman run` then fails with `error setting rlimit type 7 (nofile) / 6 (nproc): operation
# not permitted`. These flags ask for the caller's own soft limits instead, nproc at most
# kernel.pid_max (runc refuses more there too).
NOFILE=$(ulimit -n)
NPROC=$(ulimit -u)
PID_MAX=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)
if [ "$NPROC" = unlimited ] || [ "$NPROC" -gt "$PID_MAX" ]; then NPROC=$PID_MAX; fi
[ "$NOFILE" = unlimited ] && NOFILE=1048576
ULIMITS=(--ulimit "nofile=$NOFILE:$NOFILE" --ulimit "nproc=$NPROC:$NPROC")
