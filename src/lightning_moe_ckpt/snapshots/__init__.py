"""Snapshots on one rank: what a snapshot holds, the capture that copies it while the
next iteration computes, checksums, the one encoded format, and the store of windows."""
