"""Training state on disk and in host memory, without Lightning: checkpoint files and their manifest
(:mod:`.files`), each rank's shard of a checkpoint (:mod:`.shards`), and what survivors of a lost rank keep
(:mod:`.survivors`, from host copies taken off the critical path: :mod:`.host_copies`)."""
