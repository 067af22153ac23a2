"""What the `prefixkv` command runs: the CLI and the demos that show the library off.

- `cli`: the `prefixkv` command (`demo`, `analyze`, `route-demo`, `selfcheck`).
- `demo`: `prefixkv demo`, what prompt layout does to the cache, measured on the engine.
- `route_demo`: `prefixkv route-demo`, engine processes routed by their KV events.
- `tiers_demo`: ``python -m prefixkv.apps.tiers_demo``, the host and remote tiers at work.

The top of the package: nothing in the library imports it.
"""
