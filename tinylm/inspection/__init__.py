"""Looking inside a model: capture attention, read pronouns, probe and ablate heads, the
step-by-step walkthrough, figures and the TensorBoard tab."""
