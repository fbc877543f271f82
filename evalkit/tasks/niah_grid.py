"""Task module niah_grid."""
