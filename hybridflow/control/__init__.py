"""Ray Serve deployments: each one a single controller that owns its worker groups."""
