// exp(x) for a float vector: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial (the
// Cephes coefficients; within 2 ulp of expf), times 2^n built in the exponent bits. Inputs below
// kExpLo (where e^x is no longer a normal float) give exactly 0, so a masked attention score of -inf
// weighs nothing; inputs above kExpHi give +inf.
#pragma once

static constexpr float kExpHi = 88.3762626647949f;
static constexpr float kExpLo = -87.3365447505531f;  // ln(2^-126)
static constexpr float kLog2e = 1.44269504088896341f;
static constexpr float kLn2Hi = 0.693359375f;
static constexpr float kLn2Lo = -2.12194440e-4f;
static constexpr float kExpP0 = 1.9875691500e-4f;
static constexpr float kExpP1 = 1.3981999507e-3f;
static constexpr float kExpP2 = 8.3334519073e-3f;
static constexpr float kExpP3 = 4.1665795894e-2f;
static constexpr float kExpP4 = 1.6666665459e-1f;
static constexpr float kExpP5 = 5.0000001201e-1f;
