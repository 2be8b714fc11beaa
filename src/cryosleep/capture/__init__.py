"""Taking and restoring process images: CRIU provisioning and the capture steps built on it."""
