"""The discrete-event simulator, its types, and the pictures of plans and runs."""
