"""Where bytes live: locations (local, gs://, s3://), whole files, byte ranges, orbax paths, bounded retry and disk-full classification.

Import the submodules directly."""
