// The trainers of tk::dispatch's registry, compiled once for the vlbert program (main.cpp
// declares them extern): an edit to the driver does not recompile the 60 trainer types.
#define TRAINKIT_INSTANTIATE_TRAINERS
#include <trainkit/dispatch.hpp>
