"""Every reach into a private part of torch, Lightning or s3fs, one module per library.

Each function names the release it was checked against. A new release that changes one of these breaks one file,
loudly, instead of a behaviour somewhere deep in the package.
"""
