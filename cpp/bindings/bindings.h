// Registration units of the pybind11 module hot._C (module.cpp calls each).
#pragma once

#include <pybind11/pybind11.h>

namespace hotpy {

// hot._C.Config: the core's hot::Config (config.cpp).
void register_config(pybind11::module_& m);

}  // namespace hotpy
