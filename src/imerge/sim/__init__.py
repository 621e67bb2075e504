"""The simulator: one job's schedule on a cluster of any size, with the product's own policies (docs/scaling.md)."""
