# Sourced by the two-host benchmarks (netns_hierarchical.sh, netns_vs_mpi.sh):
# two network namespaces $A and $B joined by a veth pair named $DEV on both
# sides, with addresses $ADDR_A and $ADDR_B (/24). The caller sets those
# five variables first; netns_hosts_up creates them, netns_hosts_down kills
# whatever runs inside and removes them (call it from the caller's EXIT trap).
netns_hosts_down() {
  local ns
  for ns in "$A" "$B"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  # The veth pair, when netns_hosts_up failed before both ends moved into
  # the namespaces (deleting one end deletes both).
  ip link del "va$$" 2>/dev/null || true
  ip link del "vb$$" 2>/dev/null || true
}

netns_hosts_up() {
  local ns
  ip netns add "$A"
  ip netns add "$B"
  ip link add "va$$" type veth peer name "vb$$"
  ip link set "va$$" netns "$A"
  ip link set "vb$$" netns "$B"
  ip -n "$A" link set "va$$" name "$DEV"
  ip -n "$B" link set "vb$$" name "$DEV"
  ip -n "$A" addr add "$ADDR_A/24" dev "$DEV"
  ip -n "$B" addr add "$ADDR_B/24" dev "$DEV"
  for ns in "$A" "$B"; do
    ip -n "$ns" link set "$DEV" up
    ip -n "$ns" link set lo up
  done
}
