"""One script per figure; each reads run directories, analysis outputs or theory."""
