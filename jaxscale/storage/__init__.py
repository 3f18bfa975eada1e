"""Where bytes live: locations (local, gs://, s3://), whole files, byte ranges, orbax paths, bounded retry, disk-full classification and leases on one key.

Import the submodules directly."""
