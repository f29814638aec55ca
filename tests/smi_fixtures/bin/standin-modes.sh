# Sourced by the stand-ins, which need nothing on PATH (they call /bin/cat and
# /bin/sleep), so tests can give them a PATH without any real vendor tool.
# SMI_STANDIN_MODE:
#   fail  print an error to stderr and exit 1
#   hang  start a child that sleeps, write "<own pid> <child pid>" to
#         $SMI_STANDIN_PIDS (when set), and wait forever: the caller's timeout
#         must kill both
case "${SMI_STANDIN_MODE:-}" in
  "") ;;
  fail)
    echo "${0##*/}: error: unable to reach the GPU driver" >&2
    exit 1 ;;
  hang)
    /bin/sleep 3600 &
    if [ -n "${SMI_STANDIN_PIDS:-}" ]; then echo "$$ $!" > "$SMI_STANDIN_PIDS"; fi
    wait
    exit 1 ;;
  *)
    echo "stand-in: unknown SMI_STANDIN_MODE=$SMI_STANDIN_MODE" >&2
    exit 64 ;;
esac
