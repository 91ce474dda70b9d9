// The public header must compile from C++ (extern "C", no C-only constructs).
#include <cuvmm.h>

int main()
{
	return 0;
}
