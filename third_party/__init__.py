"""From-scratch re-creations of other systems' methods, used only as baselines."""
