"""The model catalog and the GPU classes models run on."""
