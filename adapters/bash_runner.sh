# The long-lived Bash worker (docs/protocol.md, "Adapters"); run by BashAdapter as
#   bash --noprofile --norc bash_runner.sh HANDLER_FILE FUNCTION SCRATCH_DIR REQ_FD RESP_FD
# with the registered working directory as cwd and BASH_ENV cleared, held (with everything it
# starts) to the registration's memory by the process that starts it (adapters/children.py:
# spawn_limited).
#
# The handler string and the payload are never evaluated as shell source: the adapter validated
# the function name and resolved the file to an absolute path inside the working directory; the
# file is sourced once, here; each call runs the function with the payload as one quoted argument.
#
# Frames (see adapters/worker.py for the handshake and the log files):
#   request:  "<id_len> <input_len> <remaining_ms> <traceparent> <type> <in> <out> <from> <nonce>\n"
#             + invocation id + input bytes; traceparent is a traced call's W3C context, "-" for
#             none (type is always json here, and in, out and from are "- - 0": the bash runtime
#             takes JSON only, inline; adapters/base.py: send_request), and the
#             function sees it as $TRACEPARENT (OpenTelemetry's environment carrier), "" for none
#   response: "D <status> <nonce>\n" once the function returned; its stdout is in
#             SCRATCH_DIR/stdout and its outputs in SCRATCH_DIR/outputs (the adapter removes that
#             file after reading it). The nonce is the request's: it proves which call this answers.
#
# The function runs in this shell, not in a job forked per call: on this machine a fork costs
# more than the rest of the call together (docs/architecture.md, "Measured facts the design rests on"; benchmarks/invoke.py). So shell state the
# function changes (variables, cwd, options) persists to its next call, like a Python handler's
# module globals. A function that ends the shell (`exit N`, `set -e`, `exec`) ends the worker
# mid-call: the adapter reports that exit status as the call's result and a fresh worker replaces
# it. Job control stays off, so everything the function starts is in the worker's process group,
# which cancellation kills.

file=$1 fn=$2 scratch=$3 req_fd=$4 resp_fd=$5
unset BASH_ENV ENV

initfail() { # errorType message
    local LC_ALL=C # ${#message} must count bytes
    printf 'INITFAIL %s %d\n%s' "$1" "${#2}" "$2" >&"$resp_fd"
    exit 0
}

if ! "$BASH" -n "$file" 2>"$scratch/init.err"; then
    initfail UserCodeSyntaxError "$(<"$scratch/init.err")"
fi
# Sourced by absolute path (". name" would search $PATH), with nothing to read on stdin.
# While the file is sourced nothing is sent on the request pipe (the server waits for READY),
# so its end of file — the server gone — is all a read there can see before the timeout: a
# watcher ends the worker's process group then, or a file that hangs as it is sourced would
# outlive the server. (The Python worker watches the same pipe for the same reason.)
(
    exec {resp_fd}>&-
    while :; do
        read -r -t 0.5 -u "$req_fd" _
        (($? > 128)) || kill -KILL 0 # not the timeout: the end of the pipe
    done
) </dev/null &
__fnkernel_watcher=$!
. "$file" </dev/null {req_fd}<&- {resp_fd}>&-
# Builtins by name: the file may have defined functions called kill or wait; and `|| :`, as
# it may have set errexit (wait answers the watcher's 143).
builtin kill "$__fnkernel_watcher" 2>/dev/null || :
builtin wait "$__fnkernel_watcher" 2>/dev/null || :
declare -F -- "$fn" >/dev/null || initfail HandlerNotFound "${file##*/} does not define a function named $fn"

export FUNCTION_OUTPUTS=$scratch/outputs
printf 'READY\n' >&"$resp_fd"

while IFS=" " read -r -u "$req_fd" id_len input_len _ __fnkernel_traceparent _ _ _ _ _ __fnkernel_nonce; do
    IFS= LC_ALL=C read -r -u "$req_fd" -N "$id_len" invocation_id
    IFS= LC_ALL=C read -r -u "$req_fd" -N "$input_len" payload
    # stdin is /dev/null so the call cannot read the next frame; the frame pipes are closed
    # for the call (bash restores them after it).
    TRACEPARENT=${__fnkernel_traceparent#-} FUNCTION_INVOCATION_ID=$invocation_id "$fn" "$payload" \
        >"$scratch/stdout" </dev/null {req_fd}<&- {resp_fd}>&-
    printf 'D %d %s\n' "$?" "$__fnkernel_nonce" >&"$resp_fd"
done
