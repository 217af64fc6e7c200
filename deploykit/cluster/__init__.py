"""Scale-out on Ray (extra ``deploykit[ray]``): pipeline stages across nodes, Ray Serve replicas, the
cluster's node inventory. Every Ray API call of deploykit lives in this package.

Importing ``deploykit.cluster`` itself imports nothing (not even ray); its modules import ray inside
their functions, through :func:`deploykit.cluster.ray_env.require_ray`, which says how to install the
extra when it is missing.
"""
