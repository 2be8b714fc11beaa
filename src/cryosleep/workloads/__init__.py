"""Small training programs shipped with Cryosleep (the demo's job). They know nothing of Cryosleep."""
