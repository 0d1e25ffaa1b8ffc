#pragma once
#include <trainkit/low/a.hpp>
