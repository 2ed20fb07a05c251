"""Replication of each rank's snapshots to replica peers: placement, the replicator and
its transport, shared-memory slots for peers on the same node, and what a peer holds."""
