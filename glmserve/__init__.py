"""glmserve: disaggregated serving for the GLM-5.2 model family."""
