"""What a run reports: metrics, timeline, test accuracy, the WSP summary."""
