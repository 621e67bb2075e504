"""The coordinator: membership, the model layout, and the published plan."""
