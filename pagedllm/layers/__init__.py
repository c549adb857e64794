"""Model building blocks shared by every model file: linear, norm, rotary, attention, ..."""
