"""tdrussell/diffusion-pipe ("the anchor") configs in diffpipe: what each of its keys becomes (:mod:`.keys`),
the hints ``diffpipe validate`` gives when it meets one, and ``diffpipe import-config`` (:mod:`.convert`)."""
