"""Failures of real processes: the supervisor that hosts the job's store and replaces
failed workers, the workers' rendezvous and heartbeat, forked workers and spares, the
survivors' and replacements' side of a recovery, and a replacement joining a running
job."""
