#pragma once
#include <trainkit/high/b.hpp>
