#pragma once
#include <type_traits>

namespace trainkit::detail {

/// `static_assert(always_false<T>, ...)` in a primary template fires only when it is used.
template <class...>
inline constexpr bool always_false = false;

template <class T, template <class> class Template>
struct is_instance_of : std::false_type {};
template <class T, template <class> class Template>
struct is_instance_of<Template<T>, Template> : std::true_type {};

}  // namespace trainkit::detail
